"""NexusKV as SGLang's HiCache storage backend (see `nexuskv_sglang.backend`)."""
