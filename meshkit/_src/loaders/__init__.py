"""Which dataset rows each process loads, for grain, Hugging Face datasets and any loader."""
