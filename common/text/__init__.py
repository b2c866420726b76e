"""Text without torch: the tokenizer and chat template, incremental detokenization, model metadata."""
