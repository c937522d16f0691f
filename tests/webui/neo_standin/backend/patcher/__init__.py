"""Stand-in of Neo's ``backend/patcher`` package (base.py: ModelPatcher, unet.py: UnetPatcher, NunchakuPatcher)."""
