"""Quantization: calibration, sensitivity, bit allocation, AWQ, recipes, artifacts."""
