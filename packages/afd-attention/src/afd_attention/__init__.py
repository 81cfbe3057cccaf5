"""afd_attention"""
