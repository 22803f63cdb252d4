"""The offline API vLLM users write: LLM (llm.py), its engine arguments, prompts, tokenizer and sampling defaults.
May import worker/, engine/, params, structured/, hub, serving/openai/chat.py and chip_child's model files."""
