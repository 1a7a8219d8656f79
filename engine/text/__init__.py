"""Text in and out: the tokenizer, the incremental detokenizer, structured-output grammars."""
