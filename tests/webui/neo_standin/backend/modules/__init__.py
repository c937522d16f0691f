"""Stand-in of Neo's ``backend/modules`` package (k_model.py: KModel, k_prediction.py: flow predictors)."""
