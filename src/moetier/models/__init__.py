"""Model families: a registry from HF architecture strings to family builders."""
