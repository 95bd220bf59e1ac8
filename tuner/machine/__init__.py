"""This machine: CPU, RAM, GPUs, unified memory and the llama.cpp builds found (``probe``); the devices
llama.cpp will use and NVML paired with them (``devices``); its identity, the same whoever asks
(``identity``)."""
