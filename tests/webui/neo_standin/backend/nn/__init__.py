"""Stand-in of Neo's ``backend/nn`` package: the DiT classes (flux, chroma, qwen, wan, lumina, svdq), tiny."""
