"""Training strategies (ddp, zero1, zero2, zero3, dp, ...): one module each, one protocol."""
