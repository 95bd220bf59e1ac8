"""Running llama.cpp: the settings of one candidate, the engines that run it in isolated processes,
the log parser and the outcome classifier. Only child processes started here import llama_cpp."""
