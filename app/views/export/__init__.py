"""Export: a run's adapter or merged model for llama.cpp, Ollama or PEFT, verified
(`view.ExportView`)."""
