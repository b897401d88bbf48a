"""Pretraining tasks (GPT, BERT, the synthetic-cost benchmark) and their stages."""
