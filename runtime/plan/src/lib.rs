//! The Rollplex plan format: the job spec every plan carries ([`spec`]), machine-independent
//! work descriptors ([`work`]), the plan types, binary and YAML codecs, validation.
pub mod spec;
pub mod work;
