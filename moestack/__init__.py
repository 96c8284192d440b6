"""moestack: PyTorch-native training for trillion-parameter hybrid-attention MoE models."""

__version__ = "0.1.0"
