"""A one-process stand-in for AxoNN under PyTorch (AxoNN itself needs CUDA and NCCL), for the torch run of
tests/ported/axonn_guide.py: the guide's API with its meaning on one GPU (the whole model, the whole
global batch), and, so the two frameworks start from the same numbers, axonmpi's initial weights and
sample order. Not a port of AxoNN: only what the guide's steps call."""
