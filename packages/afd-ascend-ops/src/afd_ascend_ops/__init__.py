"""afd_ascend_ops"""
