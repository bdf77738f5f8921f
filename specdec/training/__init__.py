"""Training the project's own models: tokenizer, target/draft pair (and later the LVLM pair)."""
