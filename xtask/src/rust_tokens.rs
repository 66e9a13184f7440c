//! Just enough of a Rust lexer for the module-cycle check: identifiers, `::` and single
//! punctuation characters, with comments, string, byte-string, raw-string and character
//! literals dropped (so `"crate::a"` or `// super::b` are not paths), and lifetimes kept apart
//! from character literals (`'a` is not the start of `'{'`).

/// One token: an identifier or keyword (`crate`, `super`, `mod`), `::`, or one punctuation
/// character (`{`, `;`, `#`, `$` ...).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Token {
    Ident(String),
    PathSep,
    Punct(char),
}

impl Token {
    pub fn is_ident(&self, s: &str) -> bool {
        matches!(self, Token::Ident(i) if i == s)
    }
    pub fn ident(&self) -> Option<&str> {
        match self {
            Token::Ident(i) => Some(i),
            _ => None,
        }
    }
}

/// The tokens of `src`. Unterminated comments or literals end the input.
pub fn tokenize(src: &str) -> Vec<Token> {
    let chars: Vec<char> = src.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c.is_whitespace() {
            i += 1;
        } else if c == '/' && next == Some('/') {
            i = skip_line(&chars, i);
        } else if c == '/' && next == Some('*') {
            i = skip_block_comment(&chars, i);
        } else if let Some(end) = raw_string_end(&chars, i) {
            i = end;
        } else if c == '"' || (c == 'b' && next == Some('"')) {
            i = skip_quoted(&chars, if c == 'b' { i + 1 } else { i }, '"');
        } else if c == 'b' && next == Some('\'') {
            i = skip_quoted(&chars, i + 1, '\'');
        } else if c == '\'' {
            // A character literal is skipped whole; a lifetime's name is then read as an
            // identifier, which is harmless.
            i = char_literal_end(&chars, i).unwrap_or(i + 1);
        } else if c.is_alphanumeric() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            out.push(Token::Ident(chars[start..i].iter().collect()));
        } else if c == ':' && next == Some(':') {
            out.push(Token::PathSep);
            i += 2;
        } else {
            out.push(Token::Punct(c));
            i += 1;
        }
    }
    out
}

fn skip_line(chars: &[char], mut i: usize) -> usize {
    while i < chars.len() && chars[i] != '\n' {
        i += 1;
    }
    i
}

/// Past a `/* ... */` comment, nested ones included.
fn skip_block_comment(chars: &[char], mut i: usize) -> usize {
    let mut depth = 0;
    while i < chars.len() {
        if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
            depth += 1;
            i += 2;
        } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
            depth -= 1;
            i += 2;
            if depth == 0 {
                return i;
            }
        } else {
            i += 1;
        }
    }
    i
}

/// Past a literal opened by `quote` at `i`, with backslash escapes.
fn skip_quoted(chars: &[char], mut i: usize, quote: char) -> usize {
    i += 1;
    while i < chars.len() {
        match chars[i] {
            '\\' => i += 2,
            c if c == quote => return i + 1,
            _ => i += 1,
        }
    }
    i
}

/// If a raw string (`r"..."`, `r#"..."#`, `br##"..."##`) starts at `i`, the index past it.
fn raw_string_end(chars: &[char], i: usize) -> Option<usize> {
    let mut j = i;
    if chars.get(j) == Some(&'b') {
        j += 1;
    }
    if chars.get(j) != Some(&'r') || (i > 0 && (chars[i - 1].is_alphanumeric() || chars[i - 1] == '_')) {
        return None;
    }
    j += 1;
    let hashes = chars[j..].iter().take_while(|c| **c == '#').count();
    j += hashes;
    if chars.get(j) != Some(&'"') {
        return None;
    }
    j += 1;
    while j < chars.len() {
        if chars[j] == '"' && chars[j + 1..].iter().take(hashes).filter(|c| **c == '#').count() == hashes {
            return Some(j + 1 + hashes);
        }
        j += 1;
    }
    Some(j)
}

/// If a character literal (`'x'`, `'\n'`, `'\u{7f}'`) starts at `i`, the index past it; `None`
/// for a lifetime or label (`'a`, `'static`).
fn char_literal_end(chars: &[char], i: usize) -> Option<usize> {
    match chars.get(i + 1)? {
        '\\' => Some(skip_quoted(chars, i, '\'')),
        _ if chars.get(i + 2) == Some(&'\'') => Some(i + 3),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn idents(src: &str) -> Vec<String> {
        tokenize(src).iter().filter_map(|t| t.ident().map(str::to_owned)).collect()
    }

    #[test]
    fn comments_and_literals_are_not_tokens() {
        let src = r##"a // crate::x
            /* outer /* nested crate::y */ still comment */ b "crate::z\" q" c b"super" d
            r#"crate::w "quoted" "# e br"x" f '{' g '\'' h '\u{7b}' i"##;
        assert_eq!(idents(src), ["a", "b", "c", "d", "e", "f", "g", "h", "i"]);
    }

    #[test]
    fn lifetimes_are_not_character_literals() {
        let toks = tokenize("fn f<'a>(x: &'a str) -> &'static str { x }");
        let braces = toks.iter().filter(|t| matches!(t, Token::Punct('{' | '}'))).count();
        assert_eq!(braces, 2);
        assert!(idents("&'a crate::b").contains(&"crate".to_owned()));
    }

    #[test]
    fn paths_have_separators() {
        assert_eq!(
            tokenize("crate::a::{b, c}"),
            vec![
                Token::Ident("crate".into()),
                Token::PathSep,
                Token::Ident("a".into()),
                Token::PathSep,
                Token::Punct('{'),
                Token::Ident("b".into()),
                Token::Punct(','),
                Token::Ident("c".into()),
                Token::Punct('}'),
            ]
        );
    }
}
