"""`outlast.train.huggingface`: Hugging Face integrations, with Ray Train's names (`transformers`)."""
