"""Images in prompts: the processor's inputs (inputs.py), content hashes (hashing.py) and the
model's own HF processor turning a prompt and its images into tokens and pixels (processing.py)."""
