"""Example `eval.backend` functions: each scores a Hugging Face snapshot of the weights at one step."""
