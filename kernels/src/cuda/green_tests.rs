//! The rounding and placement rules of SM partitions (no GPU).

use super::*;

/// The H200 as its driver (580) splits it: 15 groups of 8 SMs and 12 left over (measured).
const H200: SmLayout = SmLayout {
    total: 132,
    unit: 8,
    units: 15,
    remainder: 12,
};

#[test]
fn rounding_of_sm_counts() {
    use Placement::*;
    use Priority::*;
    let l = H200;
    // (asked, priority) -> (placement, granted)
    let cases = [
        (1, High, Front { units: 1 }, 8),
        (8, High, Front { units: 1 }, 8),
        (40, High, Front { units: 5 }, 40),
        (44, High, Front { units: 6 }, 48),
        (120, High, Front { units: 15 }, 120),
        (121, High, Whole, 132), // 16 groups do not exist
        (132, High, Whole, 132),
        (1000, High, Whole, 132),
        (1, Normal, Back { units: 1 }, 20), // a back partition holds a group and the remainder
        (20, Normal, Back { units: 1 }, 20),
        (21, Normal, Back { units: 2 }, 28),
        (80, Normal, Back { units: 9 }, 84),
        (84, Normal, Back { units: 9 }, 84),
        (52, Normal, Back { units: 5 }, 52),
        (124, Normal, Back { units: 14 }, 124),
        (125, Normal, Whole, 132),
        (132, Normal, Whole, 132),
    ];
    for (sms, prio, want, granted) in cases {
        let p = l.place(sms, prio).unwrap();
        assert_eq!(p, want, "{sms} SMs {prio:?}");
        assert_eq!(l.sms(p), granted, "{sms} SMs {prio:?}");
    }
    assert!(l.place(0, High).is_err());
    assert!(l.place(0, Normal).is_err());
    // every request gets at least what it asked (up to the GPU), less than a group more (plus
    // the remainder for the smallest back partitions)
    for sms in 1..=140 {
        for prio in [High, Normal] {
            let g = l.sms(l.place(sms, prio).unwrap());
            assert!(g >= sms.min(l.total), "{sms} {prio:?} -> {g}");
            assert!(g < sms + l.unit + l.remainder, "{sms} {prio:?} -> {g}");
        }
    }
    // the nominal layout (where the driver cannot be asked): 16 x 8 + 4
    let nominal = SmLayout::nominal(132, 8);
    assert_eq!((nominal.units, nominal.remainder), (16, 4));
    assert_eq!(nominal.sms(nominal.place(80, Normal).unwrap()), 84);
    assert_eq!(nominal.sms(nominal.place(128, High).unwrap()), 128);
    // without a remainder, back partitions are whole groups
    let no_rem = SmLayout::nominal(128, 8);
    assert_eq!(no_rem.remainder, 0);
    assert_eq!(no_rem.sms(no_rem.place(84, Normal).unwrap()), 88);
    assert_eq!(no_rem.place(128, Normal).unwrap(), Whole);
}

#[test]
fn decode_and_side_partitions_are_disjoint() {
    use Priority::*;
    let l = H200;
    // every split of the plan's kind (decode a multiple of 8, side the rest, at least a group
    // and the remainder) is disjoint and covers the GPU exactly
    for d in (8..=112).step_by(8) {
        let (a, b) = (l.place(d, High).unwrap(), l.place(132 - d, Normal).unwrap());
        assert!(l.disjoint(a, b), "{d}/{}", 132 - d);
        assert_eq!(l.sms(a) + l.sms(b), 132, "{d}/{}", 132 - d);
        let (ga, gb) = (l.groups(a), l.groups(b));
        assert!(ga.end <= gb.start, "{ga:?} {gb:?}");
    }
    let p = |s, q| l.place(s, q).unwrap();
    assert!(!l.disjoint(p(120, High), p(12, Normal))); // the side gets 20
    assert!(!l.disjoint(p(56, High), p(84, Normal))); // 56 + 84 > 132
    assert!(l.disjoint(p(40, High), p(84, Normal)));
    assert!(!l.disjoint(p(40, High), p(48, High))); // both from the front
    assert!(!l.disjoint(p(12, Normal), p(20, Normal))); // both hold the remainder
    assert!(!l.disjoint(p(40, High), p(132, Normal))); // the whole GPU
}

#[test]
fn cache_keys_follow_the_granted_sms() {
    use Priority::*;
    let l = H200;
    let key = |s, q| (l.place(s, q).unwrap(), q);
    assert_eq!(key(41, High), key(48, High));
    assert_ne!(key(48, High), key(49, High));
    assert_eq!(key(77, Normal), key(84, Normal));
    assert_ne!(key(48, High), key(48, Normal));
    // the whole GPU at two priorities is two streams
    assert_eq!(l.place(500, High).unwrap(), l.place(132, Normal).unwrap());
    assert_ne!(key(500, High), key(132, Normal));
}
