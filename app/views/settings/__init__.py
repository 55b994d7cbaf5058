"""Settings: the window's own settings, the clusters (`view.SettingsView`)."""
