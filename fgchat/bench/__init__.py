"""`fgchat bench`: latency benchmark across modes and batch sizes, with optional peers."""
