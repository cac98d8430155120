"""toolgym.agents"""
