//! Cost model.
