"""dsv4debug: find where a DeepSeek-V4 inference pipeline goes numerically wrong."""
__version__ = "0.1.0"
