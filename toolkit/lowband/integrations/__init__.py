"""lowband.Sync inside other frameworks' training loops.

transformers: the Hugging Face Trainer (`LowbandCallback`, `LowbandTrainingArguments`).
Each integration imports its framework, so import the one you use by its full name.
"""
