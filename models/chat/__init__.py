"""The chat format: the chat template's rendering, the tool-call formats (the parser and its
generative twin) and the grammars that constrain decoding. Quant's evaluation decodes through it
too, so it sits below both quant and server."""
