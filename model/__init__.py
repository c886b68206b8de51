"""glmport.model: GLM-5 written only against glmport ops (HF-compatible config and
weight names, KV cache, MTP, quantised inference). Not built yet."""
