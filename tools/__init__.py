"""toolgym.tools"""
