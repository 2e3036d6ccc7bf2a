"""The model's files as the toolkit reads them: tokenizers from a spec (``tokenizer``) and the built-in
random-weight test model (``tiny``). Below the engines, the gateway and the ranks, which all read them."""
