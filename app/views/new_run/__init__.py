"""New run: the model card, the dataset, the training settings and presets, GRPO's prompts and
rewards, where the run goes (`view.NewRunView`)."""
