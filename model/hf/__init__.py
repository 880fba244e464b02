"""Hugging Face interop: export a checkpoint as a transformers model directory, import GPT-2 / LLaMA
weights as a run directory (convert.py); the GPT-2 tokenizer files (tokenizer.py); the self-contained
modeling file of the custom variants (modeling_attn_lm.py)."""
