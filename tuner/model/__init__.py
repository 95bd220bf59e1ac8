"""GGUF models: the header reader (``gguf``), what a model is (``inspect``), memory before loading
(``estimate``), and test models made on the spot (``make``). Nothing here runs llama.cpp."""
