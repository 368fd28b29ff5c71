//! Typed indices into the plan's tables, and the half-open [`Span`] of indices.
//!
//! Every id is a `u32` newtype that indexes one vector of a [`crate::Plan`]
//! (`plan.tasks[TaskId]`, `plan.buffers[BufferId]`, ...). Ids print the way the YAML form
//! spells them (`task17`, `buf3`, `stream0`, `win2`, `gpu0`, `arena1`).
//!
//! Serde: human-readable formats (YAML) get the printed string; compact formats (postcard) get
//! the plain integer. Reading YAML accepts the string form or a bare integer.
//!
//! Invariant: an id is only meaningful together with the plan that issued it; `validate`
//! checks that every id a plan stores is in range.

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

macro_rules! define_id {
    ($(#[$doc:meta])* $name:ident, $prefix:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(pub u32);

        impl $name {
            /// The prefix of the printed form (`task` in `task17`).
            pub const PREFIX: &'static str = $prefix;

            /// The id of the `i`-th element of a table. Tables are bounded by the plan
            /// format's u32 ids; a larger index is a compiler bug, reported as such.
            pub fn from_index(i: usize) -> Self {
                match u32::try_from(i) {
                    Ok(v) => $name(v),
                    Err(_) => panic!(concat!($prefix, " index {} does not fit in u32"), i),
                }
            }

            /// The index into the table this id refers to.
            pub fn index(self) -> usize {
                self.0 as usize
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($prefix, "{}"), self.0)
            }
        }

        impl std::str::FromStr for $name {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                let digits = s.strip_prefix($prefix).unwrap_or(s);
                digits.parse::<u32>().map($name).map_err(|_| {
                    format!(concat!("`{}` is not a ", $prefix, " id (expected `", $prefix, "<number>`)"), s)
                })
            }
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                if s.is_human_readable() {
                    s.collect_str(self)
                } else {
                    s.serialize_u32(self.0)
                }
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                if d.is_human_readable() {
                    d.deserialize_any(IdVisitor::<$name>(std::marker::PhantomData))
                } else {
                    u32::deserialize(d).map($name)
                }
            }
        }

        impl IdFromU32 for $name {
            const NAME: &'static str = $prefix;
            fn from_u32(v: u32) -> Self {
                $name(v)
            }
        }
    };
}

trait IdFromU32: std::str::FromStr<Err = String> {
    const NAME: &'static str;
    fn from_u32(v: u32) -> Self;
}

struct IdVisitor<T>(std::marker::PhantomData<T>);

impl<T: IdFromU32> Visitor<'_> for IdVisitor<T> {
    type Value = T;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a {} id such as `{}0`", T::NAME, T::NAME)
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<T, E> {
        v.parse().map_err(E::custom)
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<T, E> {
        u32::try_from(v)
            .map(T::from_u32)
            .map_err(|_| E::custom(format!("{} id {v} is out of range", T::NAME)))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<T, E> {
        u32::try_from(v)
            .map(T::from_u32)
            .map_err(|_| E::custom(format!("{} id {v} is out of range", T::NAME)))
    }
}

define_id!(
    /// A task: one unit of work on one stream (`plan.tasks`).
    TaskId,
    "task"
);
define_id!(
    /// A buffer: a named region of one arena (`plan.buffers`).
    BufferId,
    "buf"
);
define_id!(
    /// A stream of one GPU (`plan.streams`).
    StreamId,
    "stream"
);
define_id!(
    /// A decode window of one GPU (`plan.windows`).
    WindowId,
    "win"
);
define_id!(
    /// One GPU program of the plan (`plan.gpus`): a set of ranks that run the same schedule.
    GpuId,
    "gpu"
);
define_id!(
    /// A memory arena: one GPU program's device memory or pinned host memory (`plan.memory.arenas`).
    ArenaId,
    "arena"
);

/// A half-open range of indices `start..end` (groups, samples). Prints as `0..4` in YAML.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Span {
    pub start: u32,
    pub end: u32,
}

impl Span {
    pub fn new(start: u32, end: u32) -> Self {
        Span { start, end }
    }
    pub fn len(&self) -> u32 {
        self.end.saturating_sub(self.start)
    }
    pub fn is_empty(&self) -> bool {
        self.end <= self.start
    }
    pub fn contains(&self, i: u32) -> bool {
        self.start <= i && i < self.end
    }
    pub fn iter(&self) -> std::ops::Range<u32> {
        self.start..self.end
    }
}

impl fmt::Display for Span {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}..{}", self.start, self.end)
    }
}

impl std::str::FromStr for Span {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("`{s}` is not a range (expected `start..end`)");
        let (a, b) = s.split_once("..").ok_or_else(bad)?;
        let start = a.trim().parse().map_err(|_| bad())?;
        let end = b.trim().parse().map_err(|_| bad())?;
        Ok(Span { start, end })
    }
}

impl Serialize for Span {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            s.collect_str(self)
        } else {
            (self.start, self.end).serialize(s)
        }
    }
}

impl<'de> Deserialize<'de> for Span {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        if d.is_human_readable() {
            let s = String::deserialize(d)?;
            s.parse().map_err(de::Error::custom)
        } else {
            let (start, end) = <(u32, u32)>::deserialize(d)?;
            Ok(Span { start, end })
        }
    }
}

/// GRPO groups named by prompt index (`prompts 0..4`) or by completion slot (`slots 4..8`):
/// see the indexing conventions in [`crate::plan`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Groups {
    Prompts(Span),
    Slots(Span),
}

impl Groups {
    pub fn span(&self) -> Span {
        match self {
            Groups::Prompts(s) | Groups::Slots(s) => *s,
        }
    }
}

impl fmt::Display for Groups {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Groups::Prompts(s) => write!(f, "prompts {s}"),
            Groups::Slots(s) => write!(f, "slots {s}"),
        }
    }
}

impl std::str::FromStr for Groups {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.split_once(' ') {
            Some(("prompts", r)) => r.parse().map(Groups::Prompts),
            Some(("slots", r)) => r.parse().map(Groups::Slots),
            _ => Err(format!(
                "`{s}` is not a group range (expected `prompts a..b` or `slots a..b`)"
            )),
        }
    }
}

impl Serialize for Groups {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            s.collect_str(self)
        } else {
            let (tag, span) = match self {
                Groups::Prompts(x) => (0u8, x),
                Groups::Slots(x) => (1u8, x),
            };
            (tag, span.start, span.end).serialize(s)
        }
    }
}

impl<'de> Deserialize<'de> for Groups {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        if d.is_human_readable() {
            let s = String::deserialize(d)?;
            s.parse().map_err(de::Error::custom)
        } else {
            let (tag, start, end) = <(u8, u32, u32)>::deserialize(d)?;
            let span = Span { start, end };
            match tag {
                0 => Ok(Groups::Prompts(span)),
                1 => Ok(Groups::Slots(span)),
                t => Err(de::Error::custom(format!(
                    "group range tag {t} is neither prompts (0) nor slots (1)"
                ))),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_print_and_parse() {
        assert_eq!(TaskId(17).to_string(), "task17");
        assert_eq!(BufferId(3).to_string(), "buf3");
        assert_eq!("win2".parse::<WindowId>().unwrap(), WindowId(2));
        assert_eq!("7".parse::<GpuId>().unwrap(), GpuId(7));
        assert!("buf3".parse::<TaskId>().is_err());
        assert_eq!("0..4".parse::<Span>().unwrap(), Span::new(0, 4));
        assert!("0-4".parse::<Span>().is_err());
    }

    #[test]
    fn ids_serde_forms() {
        let y = serde_yaml::to_string(&vec![TaskId(1), TaskId(20)]).unwrap();
        assert_eq!(y, "- task1\n- task20\n");
        let back: Vec<TaskId> = serde_yaml::from_str("- task1\n- 20\n").unwrap();
        assert_eq!(back, vec![TaskId(1), TaskId(20)]);
        let b = postcard::to_allocvec(&TaskId(300)).unwrap();
        assert_eq!(postcard::from_bytes::<TaskId>(&b).unwrap(), TaskId(300));
        let y = serde_yaml::to_string(&Span::new(2, 5)).unwrap();
        assert_eq!(y, "2..5\n");
        let g = Groups::Slots(Span::new(4, 8));
        assert_eq!(serde_yaml::to_string(&g).unwrap(), "slots 4..8\n");
        assert_eq!(
            serde_yaml::from_str::<Groups>("prompts 0..2").unwrap(),
            Groups::Prompts(Span::new(0, 2))
        );
        let b = postcard::to_allocvec(&g).unwrap();
        assert_eq!(postcard::from_bytes::<Groups>(&b).unwrap(), g);
    }
}
