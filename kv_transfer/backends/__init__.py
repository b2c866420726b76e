"""One package per KV transfer backend: tcp (asyncio stream), nixl (UCX one-sided writes), torch_dist
(a torch.distributed process group per pair). Each is imported only when chosen."""
