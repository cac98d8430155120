"""toolgym.training"""
