"""afd_ffn"""
