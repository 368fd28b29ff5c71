//! The syntax tree of a `.rpx` file, with spans; what the parser produces and the checker reads.
//!
//! Invariant: every node carries the span of its source text. Literals are already decoded
//! (numbers, units in base units, string escapes); a literal that could not be decoded is an
//! [`ExprKind::Error`] whose diagnostic was already reported.

use crate::span::Span;
use crate::units::Dim;

/// A name with its place.
#[derive(Clone, Debug, PartialEq)]
pub struct Ident {
    pub name: String,
    pub span: Span,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct File {
    pub consts: Vec<ConstDef>,
    /// The first `pipeline` block (a second one is reported as an error).
    pub pipeline: Option<Pipeline>,
    /// A top-level statement could not be parsed.
    pub broken: bool,
}

/// `const NAME = expr`
#[derive(Clone, Debug, PartialEq)]
pub struct ConstDef {
    pub name: Ident,
    pub value: Expr,
    pub span: Span,
}

/// `pipeline NAME { body }`
#[derive(Clone, Debug, PartialEq)]
pub struct Pipeline {
    pub name: Ident,
    pub body: Body,
}

/// The items between braces.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Body {
    pub items: Vec<Item>,
    /// Some statement of this body could not be parsed (or the `}` is missing): checks that
    /// would report a *missing* key stay quiet, since the key may be in the broken statement.
    pub broken: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Item {
    /// `key = value`
    Assign { key: Ident, value: Expr },
    /// `name label? { body }`; `head` spans `name label?`.
    Section {
        name: Ident,
        label: Option<Ident>,
        head: Span,
        body: Body,
    },
}

impl Item {
    pub fn key(&self) -> &Ident {
        match self {
            Item::Assign { key, .. } => key,
            Item::Section { name, .. } => name,
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Expr {
    pub kind: ExprKind,
    pub span: Span,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinOp {
    Add,
    Sub,
    Mul,
    Div,
}

impl BinOp {
    pub fn symbol(self) -> &'static str {
        match self {
            BinOp::Add => "+",
            BinOp::Sub => "-",
            BinOp::Mul => "*",
            BinOp::Div => "/",
        }
    }
}

/// A call argument: positional (`fixed(256)`) or named (`video(frames = 8)`).
#[derive(Clone, Debug, PartialEq)]
pub struct Arg {
    pub name: Option<Ident>,
    pub value: Expr,
}

#[derive(Clone, Debug, PartialEq)]
pub enum ExprKind {
    Int(i64),
    Float(f64),
    /// A number with a unit, in base units (bytes, bytes/s, FLOP/s, seconds).
    Quantity(f64, Dim),
    /// `WxH` (width, height).
    Dims(u64, u64),
    Str(String),
    Bool(bool),
    /// A bare name: a constant's name, or a symbol (`overlap`, `k3`, `H200`).
    Name(String),
    List(Vec<Expr>),
    Tuple(Vec<Expr>),
    /// `name(args)`, or `name { body }` (then `body` is set and `args` is empty).
    Call {
        name: Ident,
        args: Vec<Arg>,
        body: Option<Body>,
    },
    Neg(Box<Expr>),
    Binary(BinOp, Box<Expr>, Box<Expr>),
    /// A literal that did not decode; already reported.
    Error,
}
