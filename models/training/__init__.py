"""How the embedded model was made: the generated corpus (chat, code, JSON, tool calling), its
function catalogue, the trainer and the exporter to the published Qwen3.5 layout. Runtime code
(loading, serving, quantizing) never needs PyTorch; quant's evaluation reads the corpus here."""
