"""Bridges to other pipeline runtimes (torch.distributed.pipelining); they need torch."""
