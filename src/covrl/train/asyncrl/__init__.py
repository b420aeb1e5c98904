"""asyncrl"""
