//! A minimal, bounds-checked MessagePack reader for KV events. Every declared length is
//! checked against the bytes that remain before anything is allocated, so truncated or hostile
//! input (absurd lengths, deep nesting) yields an error, never a panic or a huge allocation.

use thiserror::Error;

#[derive(Debug, Error, PartialEq)]
pub enum MsgpackError {
    #[error("truncated at byte {0}")]
    Truncated(usize),
    #[error("declared length {len} exceeds the {remaining} bytes left")]
    Length { len: usize, remaining: usize },
    #[error("unexpected type {found:#04x} where {want} was expected")]
    Type { found: u8, want: &'static str },
    #[error("nesting deeper than {0}")]
    Depth(usize),
}

pub type Result<T> = std::result::Result<T, MsgpackError>;

const MAX_DEPTH: usize = 32;

/// A cursor over a MessagePack buffer.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

/// A decoded scalar or the header of a container.
#[derive(Debug, Clone, PartialEq)]
pub enum Value<'a> {
    Nil,
    Bool(bool),
    Uint(u64),
    Int(i64),
    Float(f64),
    Str(&'a str),
    Bin(&'a [u8]),
    Array(usize),
    Map(usize),
    Ext,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    /// Bytes read so far.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// The bytes read since `start` (a [`position`](Self::position)).
    pub fn consumed_since(&self, start: usize) -> &'a [u8] {
        self.buf.get(start..self.pos).unwrap_or_default()
    }

    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).ok_or(MsgpackError::Truncated(self.pos))?;
        let s = self.buf.get(self.pos..end).ok_or(MsgpackError::Truncated(self.pos))?;
        self.pos = end;
        Ok(s)
    }

    fn byte(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }

    #[inline]
    fn be(&mut self, n: usize) -> Result<u64> {
        let b = self.take(n)?;
        Ok(match *b {
            [x] => u64::from(x),
            [a, b] => u64::from(u16::from_be_bytes([a, b])),
            [a, b, c, d] => u64::from(u32::from_be_bytes([a, b, c, d])),
            [a, b, c, d, e, f, g, h] => u64::from_be_bytes([a, b, c, d, e, f, g, h]),
            _ => b.iter().fold(0u64, |acc, x| acc << 8 | u64::from(*x)),
        })
    }

    /// A container length, bounded by the bytes left (each element takes at least one byte).
    fn container(&mut self, len: u64, per_item: usize) -> Result<usize> {
        let len =
            usize::try_from(len).map_err(|_| MsgpackError::Length { len: usize::MAX, remaining: self.remaining() })?;
        if len.saturating_mul(per_item) > self.remaining() {
            return Err(MsgpackError::Length { len, remaining: self.remaining() });
        }
        Ok(len)
    }

    fn bytes(&mut self, len: u64) -> Result<&'a [u8]> {
        let len = self.container(len, 1)?;
        self.take(len)
    }

    /// The next value if it is an unsigned integer of any width, read without building a
    /// [`Value`] (token ids and block hashes); `None`, with nothing consumed, for anything else.
    #[inline]
    pub fn uint(&mut self) -> Result<Option<u64>> {
        let b = *self.buf.get(self.pos).ok_or(MsgpackError::Truncated(self.pos))?;
        match b {
            0x00..=0x7f => {
                self.pos += 1;
                Ok(Some(u64::from(b)))
            }
            0xcc..=0xcf => {
                self.pos += 1;
                self.be(1 << (b - 0xcc)).map(Some)
            }
            _ => Ok(None),
        }
    }

    /// Read `n` unsigned integers that each fit in a `u32`, handing each to `f`: one tight loop
    /// for token ids. `Ok(false)` at the first item that is not such an integer (the reader is
    /// left before it).
    #[inline]
    pub fn u32s(&mut self, n: usize, mut f: impl FnMut(u32)) -> Result<bool> {
        let buf = self.buf;
        let mut pos = self.pos;
        let bytes = |at: usize, k: usize| buf.get(at..at + k).ok_or(MsgpackError::Truncated(at));
        for _ in 0..n {
            let b = *buf.get(pos).ok_or(MsgpackError::Truncated(pos))?;
            let v = match b {
                0x00..=0x7f => {
                    pos += 1;
                    u32::from(b)
                }
                0xcc => {
                    let x = bytes(pos + 1, 1)?;
                    pos += 2;
                    u32::from(x[0])
                }
                0xcd => {
                    let x = bytes(pos + 1, 2)?;
                    pos += 3;
                    u32::from(u16::from_be_bytes([x[0], x[1]]))
                }
                0xce => {
                    let x = bytes(pos + 1, 4)?;
                    pos += 5;
                    u32::from_be_bytes([x[0], x[1], x[2], x[3]])
                }
                0xcf => {
                    let x = bytes(pos + 1, 8)?;
                    match u32::try_from(u64::from_be_bytes([x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7]])) {
                        Ok(v) => {
                            pos += 9;
                            v
                        }
                        Err(_) => {
                            self.pos = pos;
                            return Ok(false);
                        }
                    }
                }
                _ => {
                    self.pos = pos;
                    return Ok(false);
                }
            };
            f(v);
        }
        self.pos = pos;
        Ok(true)
    }

    /// The raw bytes of the next value if it is a string, without checking they are UTF-8 (map
    /// keys, compared against known names); `None`, with nothing consumed, for anything else.
    #[inline]
    pub fn str_bytes(&mut self) -> Result<Option<&'a [u8]>> {
        let b = *self.buf.get(self.pos).ok_or(MsgpackError::Truncated(self.pos))?;
        let len = match b {
            0xa0..=0xbf => {
                self.pos += 1;
                u64::from(b & 0x1f)
            }
            0xd9..=0xdb => {
                self.pos += 1;
                self.be(1 << (b - 0xd9))?
            }
            _ => return Ok(None),
        };
        self.bytes(len).map(Some)
    }

    /// Read the next value (containers yield their length; read their items next).
    pub fn value(&mut self) -> Result<Value<'a>> {
        let b = self.byte()?;
        Ok(match b {
            0x00..=0x7f => Value::Uint(u64::from(b)),
            0x80..=0x8f => Value::Map(self.container(u64::from(b & 0x0f), 2)?),
            0x90..=0x9f => Value::Array(self.container(u64::from(b & 0x0f), 1)?),
            0xa0..=0xbf => {
                let s = self.bytes(u64::from(b & 0x1f))?;
                Value::Str(std::str::from_utf8(s).map_err(|_| MsgpackError::Type { found: b, want: "utf-8 string" })?)
            }
            0xc0 => Value::Nil,
            0xc2 => Value::Bool(false),
            0xc3 => Value::Bool(true),
            0xc4..=0xc6 => {
                let n = self.be(1 << (b - 0xc4))?;
                Value::Bin(self.bytes(n)?)
            }
            0xc7..=0xc9 => {
                let n = self.be(1 << (b - 0xc7))?;
                self.bytes(n.saturating_add(1))?;
                Value::Ext
            }
            0xca => Value::Float(f64::from(f32::from_bits(self.be(4)? as u32))),
            0xcb => Value::Float(f64::from_bits(self.be(8)?)),
            0xcc..=0xcf => Value::Uint(self.be(1 << (b - 0xcc))?),
            0xd0 => Value::Int(i64::from(self.be(1)? as u8 as i8)),
            0xd1 => Value::Int(i64::from(self.be(2)? as u16 as i16)),
            0xd2 => Value::Int(i64::from(self.be(4)? as u32 as i32)),
            0xd3 => Value::Int(self.be(8)? as i64),
            0xd4..=0xd8 => {
                self.take(1 + (1 << (b - 0xd4)))?;
                Value::Ext
            }
            0xd9..=0xdb => {
                let n = self.be(1 << (b - 0xd9))?;
                let s = self.bytes(n)?;
                Value::Str(std::str::from_utf8(s).map_err(|_| MsgpackError::Type { found: b, want: "utf-8 string" })?)
            }
            0xdc | 0xdd => {
                let n = self.be(if b == 0xdc { 2 } else { 4 })?;
                Value::Array(self.container(n, 1)?)
            }
            0xde | 0xdf => {
                let n = self.be(if b == 0xde { 2 } else { 4 })?;
                Value::Map(self.container(n, 2)?)
            }
            0xe0..=0xff => Value::Int(i64::from(b as i8)),
            0xc1 => return Err(MsgpackError::Type { found: b, want: "a valid marker" }),
        })
    }

    /// Skip one whole value, containers included.
    pub fn skip(&mut self) -> Result<()> {
        self.skip_depth(0)
    }

    fn skip_depth(&mut self, depth: usize) -> Result<()> {
        if depth > MAX_DEPTH {
            return Err(MsgpackError::Depth(MAX_DEPTH));
        }
        match self.value()? {
            Value::Array(n) => (0..n).try_for_each(|_| self.skip_depth(depth + 1)),
            Value::Map(n) => (0..n * 2).try_for_each(|_| self.skip_depth(depth + 1)),
            _ => Ok(()),
        }
    }

    pub fn array(&mut self) -> Result<usize> {
        match self.value()? {
            Value::Array(n) => Ok(n),
            _ => Err(MsgpackError::Type { found: self.prev(), want: "array" }),
        }
    }

    fn prev(&self) -> u8 {
        self.buf.get(self.pos.saturating_sub(1)).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_scalars_and_rejects_absurd_lengths() {
        let mut r = Reader::new(&[
            0x93, 0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0, 0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfe, 0xd3, 0x80,
            0, 0, 0, 0, 0, 0, 0,
        ]);
        assert_eq!(r.value(), Ok(Value::Array(3)));
        assert_eq!(r.value(), Ok(Value::Float(1.5)));
        assert_eq!(r.value(), Ok(Value::Uint(u64::MAX - 1)));
        assert_eq!(r.value(), Ok(Value::Int(i64::MIN)));
        // An array claiming 2^32-1 items in 5 bytes.
        assert!(matches!(Reader::new(&[0xdd, 0xff, 0xff, 0xff, 0xff]).value(), Err(MsgpackError::Length { .. })));
        assert!(matches!(Reader::new(&[0xcf, 1, 2]).value(), Err(MsgpackError::Truncated(_))));
        let deep = vec![0x91u8; 1000];
        assert!(matches!(Reader::new(&deep).skip(), Err(MsgpackError::Depth(_)) | Err(MsgpackError::Length { .. })));
    }
}
