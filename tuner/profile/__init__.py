"""Profiles: the document (``document``), where they live and how they travel (``store``), apps that
load them (``apps``) and the flags other tools take (``exports``). Light: no optuna, gguf or llama_cpp."""
