"""common/model"""
