"""This machine: CPU, RAM, GPUs, unified memory and the llama.cpp builds found (``probe``)."""
