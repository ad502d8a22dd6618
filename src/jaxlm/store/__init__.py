"""Storage of runs and models: checkpoints, model folders, Hugging Face conversion, PEFT adapters."""
