"""Expert parallelism: routed experts spread over ranks (torch.distributed), one process each."""
