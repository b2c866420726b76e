"""common/kv"""
