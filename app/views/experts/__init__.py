"""Experts: where the LoRA update goes and where the router sends the tokens
(`view.ExpertsView`)."""
