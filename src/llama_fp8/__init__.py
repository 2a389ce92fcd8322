"""llama-fp8: train Llama with PyTorch FSDP2 in BF16 or FP8 and measure what FP8 buys."""

__version__ = "0.1.0"
