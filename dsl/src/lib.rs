//! The .rpx pipeline language.
