"""Hugging Face transformers export (`shatter-export --format hf`): see shatter/hf/export.py.

The modelling code carried by remote-code exports lives in shatter/hf/remote/ and imports only
torch and transformers.
"""
